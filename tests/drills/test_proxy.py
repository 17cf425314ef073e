"""The drills' TCP fault proxy (proxy.py) against plain sockets, no node processes.

The test plays both ends of link (a->b): it connects to the proxy as a, and accepts
the proxied connection on its own listener as b, so it sees exactly which bytes cross.
Arrivals are waited for with deadlines; that something is *held* is checked by a
receive that must time out (a bound, not a guess: held bytes cannot arrive).
"""
import socket
import time

import pytest

from drills.proxy import ANSWERS_HELD, BLACKHOLE, DROP, OK, ONE_WAY, ONE_WAY_REVERSE, SLOW, FaultProxy

DEADLINE_S = 5.0
HELD_S = 0.3  # how long a held direction is watched for bytes that must not come


@pytest.fixture
def upstream():
    """b's listening socket, closed afterwards."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def px(upstream):
    p = FaultProxy(["a", "b"]).start()
    p.set_target("b", "127.0.0.1", upstream.getsockname()[1])
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def socks():
    """Every socket a test opens, closed afterwards."""
    opened = []
    try:
        yield opened
    finally:
        for s in opened:
            s.close()


def dial(px, socks, a="a", b="b"):
    c = socket.create_connection(("127.0.0.1", px.port(a, b)), timeout=DEADLINE_S)
    socks.append(c)
    return c


def dial_refused(px, socks, a="a", b="b"):
    """Connect where the proxy resets the connection: the reset may come before connect()
    returns (ECONNRESET from connect) or right after (the first recv)."""
    try:
        c = dial(px, socks, a, b)
    except ConnectionResetError:
        return
    assert_closed(c)


def accept(upstream, socks, timeout_s=DEADLINE_S):
    upstream.settimeout(timeout_s)
    s, _ = upstream.accept()
    socks.append(s)
    return s


def pair(px, upstream, socks):
    c = dial(px, socks)
    return c, accept(upstream, socks)


def recv_exact(s, n, timeout_s=DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"got {buf!r}, wanted {n} bytes within {timeout_s}s")
        s.settimeout(left)
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise AssertionError(f"connection closed after {buf!r}")
        buf += chunk
    return buf


def assert_held(s, timeout_s=HELD_S):
    s.settimeout(timeout_s)
    with pytest.raises(socket.timeout):
        got = s.recv(100)
        raise AssertionError(f"expected nothing, got {got!r}")


def assert_closed(s, timeout_s=DEADLINE_S):
    """The peer closed or reset the connection (no data may arrive first)."""
    s.settimeout(timeout_s)
    try:
        got = s.recv(100)
    except ConnectionResetError:
        return
    assert got == b"", f"expected a closed connection, got {got!r}"


def assert_no_accept(upstream, timeout_s=HELD_S):
    upstream.settimeout(timeout_s)
    with pytest.raises(socket.timeout):
        s, _ = upstream.accept()
        s.close()
        raise AssertionError("the proxy connected on to b")


def both_ways(c, s, tag=b"1"):
    c.sendall(b"req" + tag)
    assert recv_exact(s, 4) == b"req" + tag
    s.sendall(b"rsp" + tag)
    assert recv_exact(c, 4) == b"rsp" + tag


def test_ok_forwards_both_ways_and_counts(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    both_ways(c, s)
    big = bytes(range(256)) * 4096  # 1 MiB through the proxy, both ways
    c.sendall(big)
    assert recv_exact(s, len(big)) == big
    s.sendall(big)
    assert recv_exact(c, len(big)) == big
    st = px.stats()["a->b"]
    assert st["bytes_fwd"] == 4 + len(big) and st["bytes_back"] == 4 + len(big)
    assert st["forwarded"] == 1 and st["open_connections"] == 1
    c.close()  # an EOF is passed on
    assert_closed(s)


def test_drop_resets_existing_and_refuses_new_then_heal(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    both_ways(c, s)
    px.set_link("a", "b", DROP)
    assert_closed(c)
    assert_closed(s)
    dial_refused(px, socks)  # accepted by the proxy, then reset at once
    assert_no_accept(upstream)
    assert px.stats()["a->b"]["reset_at_accept"] == 1
    assert px.heal() == {("a", "b"): DROP}
    c3, s3 = pair(px, upstream, socks)
    both_ways(c3, s3, b"3")


def test_slow_passes_everything_both_ways_late_and_in_order_until_heal(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    both_ways(c, s)
    delay = 0.4
    px.set_links({("a", "b"): SLOW}, delay_s=delay)
    for tag, src, dst in ((b"1", c, s), (b"2", s, c)):  # each way: not before the delay, then whole
        t0 = time.monotonic()
        src.sendall(b"late" + tag)
        assert_held(dst, timeout_s=delay * 0.75)
        assert recv_exact(dst, 5) == b"late" + tag
        assert time.monotonic() - t0 >= delay
    for i in range(20):  # many sends: all arrive, in order
        c.sendall(b"%02d" % i)
    assert recv_exact(s, 40, timeout_s=DEADLINE_S + 20 * 2 * delay) == b"".join(b"%02d" % i for i in range(20))
    with pytest.raises(ValueError):
        px.set_links({("a", "b"): SLOW})  # a slow link needs its delay
    assert px.heal() == {("a", "b"): SLOW}
    t0 = time.monotonic()
    both_ways(c, s, b"9")  # prompt again: the heal took the delay away
    assert time.monotonic() - t0 < delay


def test_blackhole_holds_both_directions_until_heal(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    both_ways(c, s)
    px.set_link("a", "b", BLACKHOLE)
    c.sendall(b"req2")
    s.sendall(b"rsp2")
    assert_held(s)
    assert_held(c)
    # a new connection is not set up either
    c2 = dial(px, socks)
    c2.sendall(b"new1")
    assert_no_accept(upstream)
    px.heal()
    assert recv_exact(s, 4) == b"req2"  # held bytes arrive in order after the heal
    assert recv_exact(c, 4) == b"rsp2"
    s2 = accept(upstream, socks)
    assert recv_exact(s2, 4) == b"new1"
    both_ways(c, s, b"3")
    both_ways(c2, s2, b"4")


def test_blackhole_holds_a_close_too(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", BLACKHOLE)
    s.close()  # b goes away: a must not notice while the link is blackholed
    assert_held(c)
    px.heal()
    assert_closed(c)


def test_one_way_passes_only_responses(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", ONE_WAY)
    c.sendall(b"req1")
    s.sendall(b"rsp1")
    assert recv_exact(c, 4) == b"rsp1"
    assert_held(s)
    px.set_link("a", "b", OK)
    assert recv_exact(s, 4) == b"req1"
    both_ways(c, s, b"2")


def test_one_way_reverse_passes_only_requests(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", ONE_WAY_REVERSE)
    c.sendall(b"req1")
    s.sendall(b"rsp1")
    assert recv_exact(s, 4) == b"req1"
    assert_held(c)
    px.heal()
    assert recv_exact(c, 4) == b"rsp1"
    both_ways(c, s, b"2")


def test_answers_held_connects_new_connections_and_holds_only_answers(px, upstream, socks):
    """As one_way_reverse on an open connection, but a new connection is connected on
    too: its request reaches b, its answer is held (a one_way_reverse link holds a new
    connection's request until the heal)."""
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", ANSWERS_HELD)
    c.sendall(b"req1")
    s.sendall(b"rsp1")
    assert recv_exact(s, 4) == b"req1"
    assert_held(c)
    c2 = dial(px, socks)
    s2 = accept(upstream, socks)
    c2.sendall(b"new1")
    assert recv_exact(s2, 4) == b"new1"
    s2.sendall(b"ans1")
    assert_held(c2)
    c2.close()  # the client gives up: its close reaches b, as its bytes do
    assert_closed(s2)
    px.heal()
    assert recv_exact(c, 4) == b"rsp1"
    both_ways(c, s, b"2")


def test_one_way_reverse_does_not_connect_a_new_connection(px, upstream, socks):
    px.set_link("a", "b", ONE_WAY_REVERSE)
    dial(px, socks).sendall(b"new1")
    assert_no_accept(upstream)


@pytest.mark.parametrize("mode", [BLACKHOLE, ANSWERS_HELD, ONE_WAY_REVERSE])
def test_heal_with_reset_discards_what_was_held(px, upstream, socks, mode):
    """heal(reset=True): the faulted link's connections are reset, the bytes they
    held (requests or answers) never arrive; new connections work again."""
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", mode)
    c.sendall(b"req1")
    s.sendall(b"rsp1")
    if mode == BLACKHOLE:
        assert_held(s)
    else:
        assert recv_exact(s, 4) == b"req1"  # requests cross
    assert_held(c)
    if mode == ONE_WAY_REVERSE:  # a new connection's request is held with it
        dial(px, socks).sendall(b"new1")
        assert_no_accept(upstream)
    assert px.heal(reset=True) == {("a", "b"): mode}
    assert_closed(s)  # (blackhole: req1 was held, and is reset instead)
    assert_closed(c)  # rsp1 was held: reset instead
    if mode == ONE_WAY_REVERSE:
        assert_no_accept(upstream)  # the held new connection was reset, not connected on
    assert px.faulted() == {}
    c3, s3 = pair(px, upstream, socks)
    both_ways(c3, s3, b"3")


def test_a_proxy_of_named_links_listens_only_for_those(upstream, socks):
    with FaultProxy(["clients", "n1", "n2"], links=[("clients", "n1"), ("clients", "n2")]) as p:
        assert set(p.modes()) == {("clients", "n1"), ("clients", "n2")}
        with pytest.raises(KeyError):
            p.port("n1", "n2")
        p.set_target("n1", "127.0.0.1", upstream.getsockname()[1])
        c = dial(p, socks, "clients", "n1")
        both_ways(c, accept(upstream, socks))


def test_blackhole_then_drop_resets_held_connections(px, upstream, socks):
    c, s = pair(px, upstream, socks)
    px.set_link("a", "b", BLACKHOLE)
    c.sendall(b"lost")
    px.set_link("a", "b", DROP)
    assert_closed(c)
    assert_closed(s)  # the held bytes never arrive: the connection is reset instead


def test_unreachable_target_resets_the_connection(upstream, socks):
    with FaultProxy(["a", "b"]) as p:
        p.set_target("b", "127.0.0.1", upstream.getsockname()[1])
        upstream.close()  # nothing listens on b's port any more
        dial_refused(p, socks)
        assert p.stats()["a->b"]["upstream_failed"] == 1


def test_links_are_independent_and_node_level_helpers():
    with FaultProxy(["n1", "n2", "n3"]) as p:
        ports = {(a, b): p.port(a, b) for a in ("n1", "n2", "n3") for b in ("n1", "n2", "n3") if a != b}
        assert len(set(ports.values())) == 6
        assert p.isolate("n1", BLACKHOLE) == {("n1", "n2"): BLACKHOLE, ("n2", "n1"): BLACKHOLE,
                                              ("n1", "n3"): BLACKHOLE, ("n3", "n1"): BLACKHOLE}
        assert p.modes()[("n2", "n3")] == OK and p.modes()[("n3", "n2")] == OK
        p.heal()
        assert p.isolate("n2", DROP, direction="out") == {("n2", "n1"): DROP, ("n2", "n3"): DROP}
        p.heal()
        assert p.isolate("n2", DROP, direction="in") == {("n1", "n2"): DROP, ("n3", "n2"): DROP}
        p.heal()
        assert p.one_way_bytes("n3", "out") == {("n3", "n1"): ONE_WAY, ("n3", "n2"): ONE_WAY,
                                                ("n1", "n3"): ONE_WAY_REVERSE, ("n2", "n3"): ONE_WAY_REVERSE}
        p.heal()
        assert p.one_way_bytes("n3", "in") == {("n3", "n1"): ONE_WAY_REVERSE, ("n3", "n2"): ONE_WAY_REVERSE,
                                               ("n1", "n3"): ONE_WAY, ("n2", "n3"): ONE_WAY}
        assert set(p.heal()) == {("n3", "n1"), ("n3", "n2"), ("n1", "n3"), ("n2", "n3")}
        assert p.slow_links("n1", 0.2) == {("n1", "n2"): SLOW, ("n1", "n3"): SLOW,
                                           ("n2", "n1"): SLOW, ("n3", "n1"): SLOW}
        assert p.modes()[("n2", "n3")] == OK
        assert set(p.heal()) == {("n1", "n2"), ("n1", "n3"), ("n2", "n1"), ("n3", "n1")}
        assert p.faulted() == {}
        with pytest.raises(ValueError):
            p.set_link("n1", "n2", "sometimes")


def test_one_link_fault_leaves_the_reverse_link_alone(socks):
    la, lb = socket.socket(), socket.socket()
    socks += [la, lb]
    for s in (la, lb):
        s.bind(("127.0.0.1", 0))
        s.listen(4)
    with FaultProxy(["a", "b"]) as p:
        p.set_target("a", "127.0.0.1", la.getsockname()[1])
        p.set_target("b", "127.0.0.1", lb.getsockname()[1])
        p.set_link("a", "b", BLACKHOLE)
        c_ba = dial(p, socks, "b", "a")  # b's calls to a cross link (b->a): still ok
        s_ba = accept(la, socks)
        both_ways(c_ba, s_ba)
        dial(p, socks, "a", "b")
        assert_no_accept(lb)


def test_close_resets_connections_and_stops_listening(upstream, socks):
    p = FaultProxy(["a", "b"]).start()
    try:
        p.set_target("b", "127.0.0.1", upstream.getsockname()[1])
        port = p.port("a", "b")
        c, s = pair(p, upstream, socks)
        p.set_link("a", "b", BLACKHOLE)
    finally:
        p.close()
    assert not p._thread.is_alive()
    assert_closed(c)
    assert_closed(s)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()
    with pytest.raises(RuntimeError):
        p.set_link("a", "b", OK)


def test_slow_makes_bytes_late_by_its_delay_also_when_many_come(px, upstream, socks):
    """``slow`` delays every byte by about its delay, however many come. When the
    next read waited for the last one's delay (0.4.30 before its release), a read
    being at most 64 KiB, more than 64 KiB sent within one delay queued behind it
    and came later and later: the link was a bandwidth cap, 64 KiB a delay, and a
    node's snapshot or catch-up behind it was slowed by far more than the delay."""
    import threading
    c, s = pair(px, upstream, socks)
    delay = 0.1
    px.set_links({("a", "b"): SLOW}, delay_s=delay)
    data = bytes(1 << 20)
    sent = []
    t = threading.Thread(target=lambda: (c.sendall(data), sent.append(time.monotonic())), daemon=True)
    t0 = time.monotonic()
    t.start()
    assert recv_exact(s, len(data), timeout_s=60) == data
    t.join(DEADLINE_S)
    assert sent
    # the last byte went out at sent[0] at the latest
    assert time.monotonic() - sent[0] <= 2 * delay + 0.5, (time.monotonic() - t0, sent[0] - t0)


def test_a_refusing_link_refuses_new_connections_keeps_its_port_and_listens_again(px, upstream, socks):
    """While its target is down (refuse), a link does not accept: a new connection is
    refused by the kernel (ECONNREFUSED), as a dead node's port is, not accepted and
    then reset; an open one is left alone. Its port stays its own, and it listens
    again on it when told."""
    c, s = pair(px, upstream, socks)
    port = px.port("a", "b")
    px.refuse("b", True)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()
    both_ways(c, s, b"2")  # the connection open before goes on
    other = socket.socket()
    socks.append(other)
    with pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # nobody else can take the port meanwhile
    assert px.stats()["a->b"]["refusing"] is True and px.stats()["a->b"]["accepted"] == 1
    px.refuse("b", False)
    c3, s3 = pair(px, upstream, socks)
    both_ways(c3, s3, b"3")
    st = px.stats()["a->b"]
    assert st["refusals"] == 1 and st["refusing"] is False and st["accepted"] == 2


def test_a_refusing_links_port_cannot_be_taken_even_by_a_socket_that_reuses_addresses(px, upstream, socks):
    """Two sockets that both set SO_REUSEADDR may share a port while neither listens,
    and a refusing link's socket does not listen: were its own SO_REUSEADDR left on, a
    process binding that port by number with it set (as servers do) would take it,
    listen there, and the link could not listen again. While it refuses, it holds the
    port alone."""
    port = px.port("a", "b")
    px.refuse("b", True)
    other = socket.socket()
    socks.append(other)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    other.close()
    px.refuse("b", False)
    c, s = pair(px, upstream, socks)
    both_ways(c, s, b"1")
