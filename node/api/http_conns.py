"""Bounds on a node's HTTP connections (limits.md, "HTTP connections and slow clients").

Three rules, each with its own mechanism:

* **How many.** At most ``most`` connections are served. The next ``spare`` are
  still accepted, so that their client reads a reason rather than a reset: the
  first request on such a connection is answered 503 ``unavailable`` (reason
  ``too_many_connections``, ``Retry-After: 1``) and the connection closes behind
  it; one that sends no request within ``grace_s`` is closed. Past those, a
  connection is closed as soon as it is accepted. The health, readiness and
  metrics routes are answered on an over-the-bound connection as usual (a probe
  that comes while the node is at its bound must not read that as a dead node),
  and it closes behind them. A flood that holds the spare too keeps a probe's
  connection out like any other: the gRPC health service is not behind this.
* **How long a client may take to ask** (aiohttp's keep-alive timer, set from
  the same figure in node/main.py): a connection whose next request head has
  not arrived whole within the client timeout, counted from its opening or its
  last answer, is closed.
* **How long a client may take to send a body**: node/api/http.py's ``_read``
  waits for a body for the client timeout at most.

* **How large a request head may be**: ``HEAD_BYTES_MAX`` from the request
  line to the blank line that ends the head. aiohttp bounds each header line
  (8,190 bytes) and their number (128), not their sum, and keeps every line of
  a head that has not come whole: about 1 MiB a connection, 4 GiB over the
  connection bound, from clients without a key (the review's run: 1,000 such
  connections took a node from 71 to 1,939 MiB, and it kept the memory).
  ``_Heads`` counts each connection's head bytes as they arrive (the body's
  bytes are skipped by the head's Content-Length, or not counted until the
  request is answered when the body is chunked); past the bound the connection
  is answered 400 ``invalid_argument`` and closed, before aiohttp sees the bytes.

aiohttp has no connection bound of its own: ``attach`` wraps the connection
callbacks its ``Server`` gets from every connection handler.
"""
from __future__ import annotations

import asyncio
import re

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from spooler import errors

# Routes answered even on a connection over the bound (then closed): probes
UNBOUNDED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

CONNECTIONS_MAX_DEFAULT = 4096
CONNECTIONS_MAX_MAX = 1_000_000
SPARE_DEFAULT = 256       # connections past the bound still told why, at once
GRACE_S_DEFAULT = 5.0     # how long such a connection may take to send its request
CLIENT_TIMEOUT_S_DEFAULT = 75.0   # aiohttp's own keep-alive default under run_app
CLIENT_TIMEOUT_S_MIN, CLIENT_TIMEOUT_S_MAX = 0.1, 3600.0


# a request head's bytes, request line to blank line: far over what this API's
# requests carry (a key, a dedup key of 128 characters, a lease token of 400)
HEAD_BYTES_MAX = 32 * 1024

_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d{1,18})[ \t]*\r?$", re.I | re.M)
_CHUNKED = re.compile(rb"^transfer-encoding[ \t]*:", re.I | re.M)


class _Heads:
    """One connection's request head bytes, counted as they arrive (see above).
    ``feed(data)`` -> False once the head being received passes HEAD_BYTES_MAX."""
    __slots__ = ("head", "body_left", "in_body")

    def __init__(self):
        self.head = bytearray()  # the head so far (at most HEAD_BYTES_MAX + 4 bytes)
        self.body_left = 0       # bytes of the last head's body still to come (not counted)
        self.in_body = False     # a body of unknown length (chunked): counted again once answered

    def feed(self, data: bytes) -> bool:
        pos, n = 0, len(data)
        while pos < n:
            if self.body_left:
                take = min(self.body_left, n - pos)
                self.body_left -= take
                pos += take
                continue
            if self.in_body:
                return True
            start = max(0, len(self.head) - 3)  # the blank line may straddle two reads
            piece = data[pos:pos + HEAD_BYTES_MAX + 4 - len(self.head)]
            self.head += piece
            end = self.head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(self.head) > HEAD_BYTES_MAX:
                    return False
                pos += len(piece)
                continue
            end += 4
            if end > HEAD_BYTES_MAX:
                return False
            pos += end - (len(self.head) - len(piece))
            head, self.head = bytes(self.head[:end]), bytearray()
            if _CHUNKED.search(head):
                self.in_body = True
            else:
                m = _CONTENT_LENGTH.search(head)
                self.body_left = int(m.group(1)) if m else 0
        return True

    def answered(self) -> None:
        self.in_body = False


class _Metered(asyncio.Protocol):
    """The protocol the transport talks to: ``inner`` (aiohttp's handler), with
    its bytes counted by ``heads`` first; ``over()`` when a head is too large."""

    def __init__(self, inner, heads: _Heads, over):
        self.inner, self.heads, self.over = inner, heads, over

    def data_received(self, data: bytes) -> None:
        if self.heads.feed(data):
            self.inner.data_received(data)
        else:
            self.over()

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class ConnectionGuard:
    def __init__(self, most: int = CONNECTIONS_MAX_DEFAULT, spare: int = SPARE_DEFAULT,
                 grace_s: float = GRACE_S_DEFAULT):
        if most < 1 or spare < 0 or grace_s <= 0:
            raise ValueError("most >= 1, spare >= 0, grace_s > 0")
        self.most, self.spare, self.grace_s = most, spare, grace_s
        self.live: set = set()   # every connection handler between made and lost
        # those accepted past the bound (answered 503, then closed), each with the
        # timer that closes it if it sends nothing within the grace
        self.over: dict = {}
        self.answered = 0        # connections told 503 too_many_connections
        self.closed = 0          # connections closed unanswered (past the spare, or silent past the grace)
        self.heads_too_large = 0  # connections closed for a request head over HEAD_BYTES_MAX

    def attach(self, server) -> None:
        """Count the connections of aiohttp's low-level ``server`` (AppRunner.server)."""
        made, lost = server.connection_made, server.connection_lost
        loop = asyncio.get_running_loop()

        def connection_made(handler, transport):
            made(handler, transport)
            self.live.add(handler)
            self._meter(handler, transport)
            n = len(self.live)
            if n > self.most + self.spare:
                self.closed += 1
                transport.abort()  # connection_lost follows, on the loop's next turn
            elif n > self.most:
                self.over[handler] = loop.call_later(self.grace_s, self._silent_past_grace, handler)

        def connection_lost(handler, exc=None):
            self.live.discard(handler)
            self._forget(handler)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost

    def _meter(self, handler, transport) -> None:
        """Count ``handler``'s request head bytes before aiohttp gets them; past
        HEAD_BYTES_MAX answer 400 and close (nothing of that read is parsed)."""
        heads = _Heads()

        def over() -> None:
            if not transport.is_closing():
                self.heads_too_large += 1
                transport.write(self._head_answer())
                transport.close()

        # (aiohttp's handler has __slots__: its data_received cannot be wrapped on
        # it, so the transport is given a protocol in front of it)
        transport.set_protocol(_Metered(handler, heads, over))

    epoch_of = None  # () -> the epoch answers name (set where the app is made)

    def _head_answer(self) -> bytes:
        """400 invalid_argument, in the contract's JSON, naming the epoch; then closed."""
        e = errors.InvalidArgument(f"request head over {HEAD_BYTES_MAX} bytes")
        body = errors.http_body(e)
        epoch = f"Spooler-Epoch: {self.epoch_of()}\r\n" if self.epoch_of is not None else ""
        return (f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n{epoch}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body

    def request_answered(self, request) -> None:
        """A request's handler is done: a chunked body's end is not counted
        (``_Heads.in_body``); the connection's next head is."""
        t = request.transport
        metered = t.get_protocol() if t is not None else None
        if isinstance(metered, _Metered):
            metered.heads.answered()

    def _forget(self, handler) -> None:
        timer = self.over.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _silent_past_grace(self, handler) -> None:
        # (a request on it is answered at once, which ends its timer: this one sent none)
        if self.over.pop(handler, None) is not None:
            self.closed += 1
            handler.force_close()

    def answering(self, request) -> bool:
        """Called once a request has come whole on a connection past the bound,
        before it is answered: ends that connection's grace (its answer closes it)
        and says whether it is refused (503) rather than a probe's."""
        self._forget(request.protocol)
        refused = request.path not in UNBOUNDED_PATHS
        if refused:
            self.answered += 1
        return refused

    def refuses(self, request) -> bool:
        """Whether ``request`` came on a connection past the bound and is not a probe:
        it is answered 503, and its connection closes (the caller does both)."""
        return self.past_bound(request) and request.path not in UNBOUNDED_PATHS

    def past_bound(self, request) -> bool:
        """Whether ``request`` came on a connection past the bound, not yet answered."""
        return request.protocol in self.over

    def collect(self):
        g = GaugeMetricFamily("spooler_http_connections", "HTTP connections open now")
        g.add_metric([], len(self.live))
        yield g
        c = CounterMetricFamily("spooler_http_connections_refused",
                                "HTTP connections past --http-max-connections: answered 503 "
                                "too_many_connections (answered) or closed unanswered (closed)", labels=["how"])
        c.add_metric(["answered"], self.answered)
        c.add_metric(["closed"], self.closed)
        yield c
        yield CounterMetricFamily("spooler_http_heads_too_large",
                                  f"HTTP connections closed for a request head over {HEAD_BYTES_MAX} bytes",
                                  value=self.heads_too_large)
