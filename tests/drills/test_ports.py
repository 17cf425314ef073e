"""The harness's port picker (nodeproc.free_ports): nodes of a cluster must know each
other's gRPC ports before any of them binds, so those ports are chosen beforehand.
They must come from outside the kernel's ephemeral range, where no outgoing connection
or bind to port 0 on the machine can take them in the meantime."""
import socket

from nodeproc import _ephemeral_low, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(10000 <= p < low for p in ports), (ports, low)
    for p in ports:  # each one still free: a plain bind succeeds
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        finally:
            s.close()


def test_a_port_in_use_is_never_handed_out():
    """Every port of a small window but three is held: the picker must find those three."""
    lo, hi = 9100, 9130  # below the range the harnesses draw from: no cluster of theirs is disturbed
    held, free = [], []
    try:
        for p in range(lo, hi):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:  # taken by someone else already: also not to be handed out
                s.close()
                continue
            held.append(s)
        for s in held[:3]:
            free.append(s.getsockname()[1])
            s.close()
        held = held[3:]
        assert sorted(free_ports(3, lowest=lo, highest=hi)) == sorted(free)
    finally:
        for s in held:
            s.close()


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound():
    """A port drawn for a node that has not bound it yet passes the bind check: a
    second draw took it (under two test workers a node's HTTP port came out equal
    to the gRPC port its cluster had drawn for it, and it would not start). So
    draws of one process never repeat a port while half its window is unused."""
    lo, hi = 9140, 9144  # four ports below the range the harnesses draw from
    for _ in range(5):  # (without the rule, two draws of two are disjoint one time in six)
        firsts = free_ports(2, lowest=lo, highest=hi)
        seconds = free_ports(2, lowest=lo, highest=hi)
        assert sorted(firsts + seconds) == list(range(lo, hi)), (firsts, seconds)
