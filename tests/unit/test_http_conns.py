"""The HTTP connection bound's bookkeeping (node/api/http_conns.py) against a stand-in
for aiohttp's low-level Server; the node-level behaviour is in
tests/integration/test_http_connections.py. And the node's open-files limit, raised
toward what its connections need (node/main.py fit_fd_limit)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from node.api.http_conns import ConnectionGuard


class _Server:
    """What ConnectionGuard.attach wraps: aiohttp's Server keeps its handlers."""

    def __init__(self):
        self.connections = {}

    def connection_made(self, handler, transport):
        self.connections[handler] = transport

    def connection_lost(self, handler, exc=None):
        self.connections.pop(handler, None)


class _Transport:
    def __init__(self):
        self.aborted = False
        self.protocol = None

    def abort(self):
        self.aborted = True

    def set_protocol(self, protocol):
        self.protocol = protocol


class _Handler:
    def __init__(self):
        self.forced = False

    def force_close(self):
        self.forced = True


class _Request:
    def __init__(self, protocol, path="/v1/queues"):
        self.protocol, self.path = protocol, path


def test_within_the_bound_served_then_told_then_closed_at_once():
    async def run():
        server, guard = _Server(), ConnectionGuard(most=2, spare=1, grace_s=60)
        guard.attach(server)
        hs, ts = [_Handler() for _ in range(4)], [_Transport() for _ in range(4)]
        for h, t in zip(hs, ts):
            server.connection_made(h, t)
        assert server.connections.keys() == set(hs)  # aiohttp's own bookkeeping still runs
        # the third is told why; the fourth, past the spare too, is closed, never answered
        assert [guard.refuses(_Request(h)) for h in hs] == [False, False, True, False]
        assert [t.aborted for t in ts] == [False, False, False, True]  # past the spare: closed at once
        assert guard.closed == 1
        # probes are answered on a connection past the bound (then closed by the caller)
        assert not guard.refuses(_Request(hs[2], "/healthz")) and guard.past_bound(_Request(hs[2], "/healthz"))
        for h in (hs[3], hs[0]):  # one leaves: the live count falls
            server.connection_lost(h)
        assert len(guard.live) == 2 and hs[0] not in server.connections
        h5, t5 = _Handler(), _Transport()
        server.connection_made(h5, t5)  # the third live: past the bound, told
        assert guard.refuses(_Request(h5)) and not t5.aborted
        server.connection_lost(hs[2])
        assert not guard.past_bound(_Request(hs[2]))  # forgotten once lost
        fams = {f.name: f for f in guard.collect()}
        assert fams["spooler_http_connections"].samples[0].value == 2
    asyncio.run(run())


def test_a_silent_connection_past_the_bound_is_closed_after_the_grace():
    async def run():
        server, guard = _Server(), ConnectionGuard(most=1, spare=4, grace_s=0.05)
        guard.attach(server)
        inside, over, gone = _Handler(), _Handler(), _Handler()
        for h in (inside, over, gone):
            server.connection_made(h, _Transport())
        server.connection_lost(gone)  # left before its grace ended: nothing to close
        await asyncio.sleep(0.2)
        assert over.forced and not inside.forced and not gone.forced
        assert guard.closed == 1 and not guard.past_bound(_Request(over))
    asyncio.run(run())


@pytest.mark.parametrize("most, spare, grace_s", [(0, 1, 1), (1, -1, 1), (1, 1, 0)])
def test_a_bound_that_serves_nothing_is_refused(most, spare, grace_s):
    with pytest.raises(ValueError):
        ConnectionGuard(most, spare, grace_s)


def test_the_open_files_limit_is_raised_toward_what_the_connections_need():
    """Started with a soft limit of 256 under a higher hard one, the node's start
    raises it to what it asks for (as far as the hard limit allows), and leaves a
    higher one alone."""
    code = ("import resource\n"
            "from node.main import fit_fd_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "want = 1000 if hard == resource.RLIM_INFINITY else min(hard, 1000)\n"
            "assert fit_fd_limit(1000) == want, fit_fd_limit(1000)\n"
            "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want\n"
            "assert fit_fd_limit(300) == want\n"
            "print('ok', want)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_a_connection_answered_or_gone_past_the_bound_ends_its_grace_timer():
    """A request answered on a connection past the bound ends its grace (its answer
    closes it; it is counted answered, not closed), and so does the connection's
    end: no timer outlives its connection."""
    async def run():
        server, guard = _Server(), ConnectionGuard(most=1, spare=4, grace_s=0.05)
        guard.attach(server)
        inside, asked, probed, gone = _Handler(), _Handler(), _Handler(), _Handler()
        for h in (inside, asked, probed, gone):
            server.connection_made(h, _Transport())
        timer = guard.over[gone]
        assert guard.answering(_Request(asked)) is True   # refused: 503
        assert guard.answering(_Request(probed, "/readyz")) is False  # a probe: answered as usual
        server.connection_lost(gone)
        assert timer.cancelled() and not guard.over.get(gone)
        await asyncio.sleep(0.2)
        assert not asked.forced and not probed.forced and not gone.forced
        assert guard.answered == 1 and guard.closed == 0
    asyncio.run(run())


def test_a_head_is_counted_across_reads_and_a_body_is_skipped_by_its_length():
    """_Heads, the request head meter: the blank line may come split over two
    reads; a body's bytes (by Content-Length) are not a head, nor a chunked one's
    until its request is answered; a head past HEAD_BYTES_MAX is refused however
    it is cut."""
    from node.api.http_conns import HEAD_BYTES_MAX, _Heads

    h = _Heads()
    head = b"POST /v1/queues/q/messages HTTP/1.1\r\nContent-Length: 50000\r\n\r"
    assert h.feed(head) and h.feed(b"\n" + b"b" * 30_000) and h.feed(b"b" * 20_000)
    assert (h.body_left, bytes(h.head)) == (0, b"")
    # two pipelined heads and a body in one read, then a chunked one
    assert h.feed(b"GET / HTTP/1.1\r\n\r\nPOST / HTTP/1.1\r\ncontent-length:3\r\n\r\nabcGET")
    assert bytes(h.head) == b"GET"
    assert h.feed(b" / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"x" * (2 * HEAD_BYTES_MAX))
    assert h.in_body
    h.answered()
    assert h.feed(b"G" * HEAD_BYTES_MAX) and not h.feed(b"E")  # one byte past: refused
    assert not _Heads().feed(b"x" * (HEAD_BYTES_MAX - 2) + b"\r\n\r\n" + b"y" * 20)  # whole, but too large
    assert _Heads().feed(b"x" * (HEAD_BYTES_MAX - 4) + b"\r\n\r\n" + b"y" * 20)  # whole, and just fits
