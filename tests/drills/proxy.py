"""A userspace TCP fault proxy between the nodes of a drill cluster (no netem needed).

For every ordered pair of nodes (a, b) the proxy listens on an ephemeral port of
127.0.0.1 and forwards each accepted connection to b's real gRPC address. Node a is
started with that port as b's address in its ``--peers``, so every gRPC call a makes
to b (log shipping, heartbeats, votes, forwarded client calls) and its responses
cross the *link* (a->b). Calls b makes to a cross the other link, (b->a).

A link carries bytes in two directions: *forward* (from a, the connecting side, to
b) and *back* (from b to a). Each link has one mode, switchable at any time from any
thread; a change applies to the link's existing connections as well as new ones
before the call returns:

``ok``
    Both directions forwarded.
``drop``
    Every connection of the link is reset (RST: SO_LINGER 0, then close) on both
    sides, and a new connection is accepted and reset at once, so the connecting
    node sees a refused/reset connection. Like ``iptables -j REJECT --reject-with
    tcp-reset``.
``blackhole``
    Connections stay open but nothing crosses in either direction. Bytes (and an
    EOF or a reset of either side) are *held*: the proxy stops reading, so they wait
    in its buffer and the kernel's socket buffers and TCP flow control pushes back on
    the sender, as with an ``iptables -j DROP`` that TCP retransmits through. A new
    connection is accepted (a userspace proxy cannot refuse the handshake silently)
    but the proxy does not connect on to b until the link is ok again. Like a real
    DROP, only timeouts notice: the nodes' failover timeout, gRPC deadlines and
    keepalive.
``one_way``
    Only the back direction (b->a, responses) is forwarded; forward bytes (a's
    requests) are held as in ``blackhole``.
``one_way_reverse``
    Only the forward direction (a->b, requests) is forwarded; b's bytes to a
    (responses) are held. b receives and executes a's calls, a never hears back.
``answers_held``
    As ``one_way_reverse``, but a new connection is connected on to b as well (as a
    load balancer that accepted it would): every request reaches b and runs there,
    every answer is held. For the links between clients and a node.
``slow``
    Both directions forwarded, late: each read is passed on ``delay_s`` after it was
    read (``slow_links``), while reading goes on, so every byte arrives about
    ``delay_s`` after it was sent, in order, nothing lost, however many come (a long
    link, not a narrow one). Only timeouts and clocks notice (heartbeats late, a
    quorum slow to answer, a lease's answer arriving near its end). Bytes already on
    their way when the link heals still arrive late; new connections are set up
    without delay.

Held bytes are delivered in order when the link becomes ok again (heal), like TCP
retransmissions after a DROP rule is removed: a stale frame of a deposed primary
can then arrive late, which the nodes' epoch checks must refuse. ``heal(reset=True)``
resets the faulted links' connections first instead (held bytes are discarded, both
ways): nothing held reaches either side after the heal. Bytes already
handed to the destination socket when a fault starts are in flight and still
arrive. A connection that has not been forwarded yet (accepted under a fault) is
only connected on to b once *both* directions pass: a TCP handshake needs packets
both ways.

Node-level faults are built from link modes (``isolate``, ``one_way_bytes``,
``slow_links``):

* a partition of node X from the others: both links (X->Y and Y->X) of every other
  node Y in ``drop`` or ``blackhole``;
* a one-way partition of *calls* (``isolate(x, mode, direction="out")``): X's calls
  to the others fail (links X->Y faulted) while their calls to X work fully (Y->X
  ok, responses included); ``direction="in"`` is the reverse;
* a one-way partition of *bytes* (``one_way_bytes(x, "out")``): every byte X sends to
  the others is held (X->Y ``one_way``, Y->X ``one_way_reverse``) while their bytes
  reach X: the others' calls reach X and run there, but X's answers never arrive.
  ``"in"`` is the reverse;
* slow links of X (``slow_links(x, delay_s)``): both links with every other node
  ``slow``, every byte between X and them late.

``refuse(b, True)`` makes every link to b stop listening, so that a new connection is
refused by the kernel (ECONNREFUSED), as b's own port is while b's process is gone;
``refuse(b, False)`` makes them listen again on the same ports, which no other socket can
take meanwhile (the drills' cluster does both as its nodes go down and come back). Without it a connection to a dead b would be
accepted by the proxy and then reset, which a client reads as a call that may have
reached b.

A proxy need not have every ordered pair as a link: ``links=[(a, b), ...]`` names the
ones it listens for (the drill's client proxy has one per node's HTTP port and one per
its gRPC port, all from a pseudo-node of the clients).

Usage (the proxy runs an asyncio loop in a daemon thread of the calling process)::

    with FaultProxy(["n1", "n2", "n3"]) as px:
        px.set_target("n2", "127.0.0.1", 50062)
        port = px.port("n1", "n2")       # n1's --peers names n2 as 127.0.0.1:<port>
        px.set_link("n1", "n2", "blackhole")
        px.isolate("n1", "drop")
        px.heal()

``close()`` (also on ``__exit__``) closes the listeners, resets every connection,
stops the loop and joins the thread.
"""
from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from typing import Iterable, Optional

OK, DROP, BLACKHOLE, ONE_WAY, ONE_WAY_REVERSE = "ok", "drop", "blackhole", "one_way", "one_way_reverse"
ANSWERS_HELD, SLOW = "answers_held", "slow"
MODES = (OK, DROP, BLACKHOLE, ONE_WAY, ONE_WAY_REVERSE, ANSWERS_HELD, SLOW)
# (forward a->b passes, back b->a passes, new connections are connected on to b) per
# mode; drop passes nothing (and resets)
_PASSES = {OK: (True, True, True), DROP: (False, False, False), BLACKHOLE: (False, False, False),
           ONE_WAY: (False, True, False), ONE_WAY_REVERSE: (True, False, False),
           ANSWERS_HELD: (True, False, True), SLOW: (True, True, True)}
_CHUNK = 65536


_BACKLOG = 128


def _listener(host: str) -> socket.socket:
    """A listening socket on a free port, bound to that port by number: a socket
    bound to port 0 gives its port up when its listening is shut down (``refuse``),
    one bound by number keeps it. The port is learnt from a first socket, which holds
    it until the second is bound beside it (both with SO_REUSEADDR, neither listening
    yet), so no other process can take it in between."""
    first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind((host, 0))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, first.getsockname()[1]))
        except BaseException:
            sock.close()
            raise
    finally:
        first.close()
    sock.listen(_BACKLOG)
    sock.setblocking(False)
    return sock


def _reset(writer: Optional[asyncio.StreamWriter]) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN."""
    if writer is None:
        return
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


def _close(writer: Optional[asyncio.StreamWriter]) -> None:
    if writer is not None:
        writer.transport.close()


class _Link:
    def __init__(self, src: str, dst: str):
        self.src, self.dst = src, dst
        self.mode = OK
        self.delay_s = 0.0             # slow: how late each read is passed on
        self.fwd = asyncio.Event()     # forward bytes (src -> dst) may pass
        self.back = asyncio.Event()    # back bytes (dst -> src) may pass
        self.open = asyncio.Event()    # new connections may be set up (both pass, or answers_held)
        for ev in (self.fwd, self.back, self.open):
            ev.set()
        self.conns: set = set()
        self.sock: Optional[socket.socket] = None      # the listening socket (its port held for good)
        self.server: Optional[asyncio.base_events.Server] = None  # accepting for it, while it listens
        self.closed_servers: list = []  # servers closed by refusals (their connections may live on)
        self.port = 0
        self.stats = {"accepted": 0, "reset_at_accept": 0, "forwarded": 0, "upstream_failed": 0,
                      "reset_by_fault": 0, "bytes_fwd": 0, "bytes_back": 0,
                      "refusals": 0}  # times it stopped listening (refuse)

    @property
    def refusing(self) -> bool:
        """Not listening (``refuse``): no server accepts for it."""
        return self.server is None

    def apply(self, mode: str, delay_s: float = 0.0) -> None:
        self.mode = mode
        self.delay_s = delay_s if mode == SLOW else 0.0
        f, b, o = _PASSES[mode]
        for ev, on in ((self.fwd, f), (self.back, b), (self.open, o)):
            ev.set() if on else ev.clear()


class _Conn:
    __slots__ = ("task", "down", "up", "reset")

    def __init__(self, task, down):
        self.task, self.down, self.up = task, down, None
        self.reset = False


class _Broken(Exception):
    """A side of the connection failed (reset, error): reset the other side too."""


class FaultProxy:
    def __init__(self, nodes: Iterable[str], host: str = "127.0.0.1",
                 links: Optional[Iterable[tuple[str, str]]] = None):
        """links: the ordered pairs (a, b) to listen for (default every pair of nodes)."""
        self.nodes = list(nodes)
        self.host = host
        self.pairs = ([(a, b) for a in self.nodes for b in self.nodes if a != b] if links is None
                      else [tuple(k) for k in links])
        self.targets: dict[str, tuple[str, int]] = {}
        self._links: dict[tuple[str, str], _Link] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._tearing_down = False  # the loop's teardown began: no listener is touched again

    # -- lifecycle (any thread) ---------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> "FaultProxy":
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise RuntimeError(f"fault proxy did not start within {timeout_s}s")
        if self._error is not None:
            self.close()
            raise RuntimeError(f"fault proxy failed to start: {self._error!r}") from self._error
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the listeners, reset every connection, stop the loop, join the thread."""
        if self._closed:
            return
        self._closed = True
        loop, t = self._loop, self._thread
        if loop is not None and t is not None and t.is_alive():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # loop already closed
                pass
            t.join(timeout_s)
            if t.is_alive():
                raise RuntimeError("fault proxy thread did not stop")

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(self._setup())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._teardown())
                rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in rest:
                    t.cancel()
                if rest:
                    loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            finally:
                loop.close()

    async def _setup(self) -> None:
        for a, b in self.pairs:
            link = _Link(a, b)
            link.sock = _listener(self.host)
            link.port = link.sock.getsockname()[1]
            await self._listen(link)
            self._links[(a, b)] = link

    async def _listen(self, link: _Link) -> None:
        """Serve the link's listener with an asyncio server, which accepts every
        connection waiting at each wake-up, in the selector's callback, and goes on
        after an accept that fails. The server gets a duplicate of the listening
        socket's descriptor, which its close() closes: the listening socket itself,
        and its port, stay the link's (``_refuse``)."""
        dup = socket.socket(fileno=os.dup(link.sock.fileno()))
        dup.setblocking(False)
        link.server = await asyncio.start_server(lambda r, w, link=link: self._serve(link, r, w), sock=dup)

    async def _teardown(self) -> None:
        self._tearing_down = True
        for link in self._links.values():
            if link.server is not None:
                link.server.close()
        tasks = []
        for link in self._links.values():
            for c in list(link.conns):
                c.reset = True
                c.task.cancel()
                tasks.append(c.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for link in self._links.values():
            for server in [link.server, *link.closed_servers]:
                if server is not None:
                    await server.wait_closed()
            if link.sock is not None:
                link.sock.close()
        for _ in range(3):  # let the transports' scheduled connection_lost callbacks run
            await asyncio.sleep(0)

    def _call(self, coro, timeout_s: float = 10.0):
        if self._loop is None or self._closed:
            coro.close()
            raise RuntimeError("fault proxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- configuration and faults (any thread) --------------------------------------------------
    def port(self, a: str, b: str) -> int:
        """The listening port of link (a->b): a's address for b."""
        return self._links[(a, b)].port

    def address(self, a: str, b: str) -> str:
        return f"{self.host}:{self.port(a, b)}"

    def set_target(self, node: str, host: str, port: int) -> None:
        """Where connections to ``node`` go (its real gRPC address); read at each connect."""
        self.targets[node] = (host, int(port))

    def set_links(self, modes: dict, delay_s: float = 0.0) -> None:
        """Set several links' modes in one step: {(a, b): mode}. Returns once every
        connection of a dropped link is reset. ``delay_s``: of the links set ``slow``."""
        for k, m in modes.items():
            if k not in self._links:
                raise KeyError(f"no link {k}")
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}")
        if SLOW in modes.values() and not delay_s > 0:
            raise ValueError("a slow link needs a delay")
        self._call(self._set_links(dict(modes), delay_s))

    def set_link(self, a: str, b: str, mode: str) -> None:
        self.set_links({(a, b): mode})

    async def _set_links(self, modes: dict, delay_s: float = 0.0) -> None:
        victims = []
        for k, m in modes.items():
            link = self._links[k]
            link.apply(m, delay_s)
            if m == DROP:
                for c in list(link.conns):
                    c.reset = True
                    c.task.cancel()
                    victims.append(c.task)
                    link.stats["reset_by_fault"] += 1
        if victims:
            await asyncio.wait(victims, timeout=5)

    def refuse(self, dst: str, on: bool) -> None:
        """While ``on``, every link to ``dst`` stops listening: a new connection is
        refused (RST to the SYN, ECONNREFUSED), as when ``dst``'s process is gone and
        the kernel refuses its port, instead of being accepted and then reset once the
        proxy cannot connect on. Its port stays the link's (a listener shut down, not
        closed), and it listens again when ``on`` is false. Connections already open
        are left alone (the target's end of them resets them by itself)."""
        self._call(self._refuse(dst, on))

    async def _refuse(self, dst: str, on: bool) -> None:
        if self._tearing_down:  # its listeners are being closed: none is to listen again
            raise RuntimeError("fault proxy is closing")
        for link in self._links.values():
            if link.dst != dst or link.refusing == on:
                continue
            if on:
                # The server stops accepting (its duplicate descriptor closed, at once;
                # not waited for: its wait_closed would wait for every connection it
                # accepted to end), then the listening socket stops listening:
                # connections still in its backlog are reset, new ones refused; the port
                # stays bound to it.
                link.server.close()
                link.closed_servers.append(link.server)
                link.server = None
                link.sock.shutdown(socket.SHUT_RD)
                # Its SO_REUSEADDR off while it does not listen: another socket setting it
                # could bind the port beside it meanwhile, and this one not listen again.
                link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
                link.stats["refusals"] += 1
            else:
                link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                link.sock.listen(_BACKLOG)  # (should this fail, the link still refuses)
                await self._listen(link)

    def modes(self) -> dict:
        """{(a, b): mode} of every link."""
        return {k: link.mode for k, link in self._links.items()}

    def faulted(self) -> dict:
        return {k: m for k, m in self.modes().items() if m != OK}

    def stats(self) -> dict:
        """{"a->b": counters} (connections accepted/forwarded/reset, bytes each way)."""
        return self._call(self._stats())

    async def _stats(self) -> dict:
        return {f"{a}->{b}": dict(link.stats, mode=link.mode, open_connections=len(link.conns),
                                  refusing=link.refusing)
                for (a, b), link in self._links.items()}

    def heal(self, reset: bool = False) -> dict:
        """Every link back to ok; returns the links that were faulted {(a, b): mode}.
        reset: the faulted links' connections are reset first (as ``drop`` does), so the
        bytes they held are discarded instead of delivered."""
        was = self.faulted()
        if was and reset:
            self.set_links({k: DROP for k in was})
        if was:
            self.set_links({k: OK for k in was})
        return was

    def isolate(self, node: str, mode: str = DROP, direction: str = "both",
                others: Optional[Iterable[str]] = None) -> dict:
        """Fault the links between ``node`` and ``others`` (default: every other node).
        direction "both": node->o and o->node; "out": node->o only (node's calls fail,
        the others' calls to it work); "in": o->node only. Returns the modes set."""
        others = [o for o in (others if others is not None else self.nodes) if o != node]
        modes: dict = {}
        for o in others:
            if direction in ("both", "out"):
                modes[(node, o)] = mode
            if direction in ("both", "in"):
                modes[(o, node)] = mode
            if direction not in ("both", "out", "in"):
                raise ValueError(f"direction must be both, out or in, not {direction!r}")
        self.set_links(modes)
        return modes

    def one_way_bytes(self, node: str, direction: str = "out", others: Optional[Iterable[str]] = None) -> dict:
        """Hold every byte ``node`` sends to the others ("out") or they send to it ("in"),
        on the connections of both links, while the opposite bytes flow."""
        others = [o for o in (others if others is not None else self.nodes) if o != node]
        if direction == "out":
            modes = {**{(node, o): ONE_WAY for o in others}, **{(o, node): ONE_WAY_REVERSE for o in others}}
        elif direction == "in":
            modes = {**{(node, o): ONE_WAY_REVERSE for o in others}, **{(o, node): ONE_WAY for o in others}}
        else:
            raise ValueError(f"direction must be out or in, not {direction!r}")
        self.set_links(modes)
        return modes

    def slow_links(self, node: str, delay_s: float, others: Optional[Iterable[str]] = None) -> dict:
        """Every byte between ``node`` and the others (default: every other node), both
        ways, passed on ``delay_s`` late (mode ``slow``)."""
        others = [o for o in (others if others is not None else self.nodes) if o != node]
        modes = {**{(node, o): SLOW for o in others}, **{(o, node): SLOW for o in others}}
        self.set_links(modes, delay_s)
        return modes

    # -- the connections (loop thread) ------------------------------------------------------------
    async def _serve(self, link: _Link, dr: asyncio.StreamReader, dw: asyncio.StreamWriter) -> None:
        link.stats["accepted"] += 1
        if link.mode == DROP:
            link.stats["reset_at_accept"] += 1
            _reset(dw)
            return
        conn = _Conn(asyncio.current_task(), dw)
        link.conns.add(conn)
        pumps: list = []
        try:
            await link.open.wait()  # a handshake needs both directions (answers_held: the proxy stands in)
            target = self.targets.get(link.dst)
            if target is None:
                raise _Broken("no target")
            try:
                ur, uw = await asyncio.open_connection(*target)
            except OSError:
                link.stats["upstream_failed"] += 1
                raise _Broken("upstream refused") from None
            conn.up = uw
            link.stats["forwarded"] += 1
            pumps = [asyncio.create_task(self._pump(link, dr, uw, link.fwd, "bytes_fwd")),
                     asyncio.create_task(self._pump(link, ur, dw, link.back, "bytes_back"))]
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise _Broken(repr(t.exception()))
            # both sides sent EOF (and it was passed on): a clean close
        except (_Broken, asyncio.CancelledError):
            conn.reset = True
        finally:
            for t in pumps:
                t.cancel()
            if pumps:
                try:
                    await asyncio.gather(*pumps, return_exceptions=True)
                except asyncio.CancelledError:
                    # cancelled again while the pumps end (the proxy stopping): this
                    # connection's task must not end cancelled, or asyncio's stream
                    # server logs a traceback for it ("Exception in callback")
                    conn.reset = True
            if conn.reset:
                _reset(dw)
                _reset(conn.up)
            else:
                _close(dw)
                _close(conn.up)
            link.conns.discard(conn)

    @staticmethod
    async def _pump(link: _Link, r: asyncio.StreamReader, w: asyncio.StreamWriter, gate: asyncio.Event,
                    counter: str) -> None:
        """Copy r to w while ``gate`` is set; bytes read while it is clear are held until it
        is set again. An EOF is passed on (half-close); an error raises (both get reset).

        Reading and passing on are two tasks with a queue between them: each read is
        stamped with when it may pass (now, or ``delay_s`` later on a slow link), and
        reading goes on meanwhile, so a slow link delays every byte by its delay however
        many come, and is no cap on how many."""
        late: asyncio.Queue = asyncio.Queue()

        async def read_on() -> None:
            while True:
                await gate.wait()
                try:
                    data = await r.read(_CHUNK)
                except (ConnectionError, OSError) as e:
                    await gate.wait()  # a reset is held like bytes are
                    raise _Broken(repr(e)) from None
                await gate.wait()
                late.put_nowait((time.monotonic() + link.delay_s, data))
                if not data:
                    return

        async def pass_on() -> None:
            while True:
                due, data = await late.get()
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                await gate.wait()
                if not data:
                    try:
                        if w.can_write_eof():
                            w.write_eof()
                    except (ConnectionError, OSError, RuntimeError) as e:
                        raise _Broken(repr(e)) from None
                    return
                link.stats[counter] += len(data)
                try:
                    w.write(data)
                    await w.drain()
                except (ConnectionError, OSError, RuntimeError) as e:
                    raise _Broken(repr(e)) from None

        tasks = [asyncio.create_task(read_on()), asyncio.create_task(pass_on())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
