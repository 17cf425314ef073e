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

aiohttp has no connection bound of its own: ``attach`` wraps the connection
callbacks its ``Server`` gets from every connection handler.
"""
from __future__ import annotations

import asyncio

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Routes answered even on a connection over the bound (then closed): probes
UNBOUNDED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

CONNECTIONS_MAX_DEFAULT = 4096
CONNECTIONS_MAX_MAX = 1_000_000
SPARE_DEFAULT = 256       # connections past the bound still told why, at once
GRACE_S_DEFAULT = 5.0     # how long such a connection may take to send its request
CLIENT_TIMEOUT_S_DEFAULT = 75.0   # aiohttp's own keep-alive default under run_app
CLIENT_TIMEOUT_S_MIN, CLIENT_TIMEOUT_S_MAX = 0.1, 3600.0


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

    def attach(self, server) -> None:
        """Count the connections of aiohttp's low-level ``server`` (AppRunner.server)."""
        made, lost = server.connection_made, server.connection_lost
        loop = asyncio.get_running_loop()

        def connection_made(handler, transport):
            made(handler, transport)
            self.live.add(handler)
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
