"""The drills' cluster helper (cluster.py) without node processes: its watcher, which
makes a down node's proxy links refuse connections, against stand-in processes and
proxies."""
import threading

from drills.cluster import GRPC, Cluster
from nodeproc import wait_until


class _Proc:
    """A node's process as the watcher sees it: running or gone."""

    def __init__(self):
        self.up = True

    def alive(self):
        return self.up

    def kill(self):
        self.up = False


class _Proxy:
    """Records the refusals it is told; the first ``fail`` of them raise, as a listener
    that cannot listen again does (its port taken meanwhile)."""

    def __init__(self, fail=0):
        self.fail, self.calls, self.closed = fail, [], False
        self.lock = threading.Lock()

    def refuse(self, dst, on):
        with self.lock:
            if self.fail:
                self.fail -= 1
                raise OSError(98, "Address already in use")
            self.calls.append((dst, on))

    def close(self):
        self.closed = True


def _cluster(tmp_path, proxy, client_proxy=None):
    c = Cluster(str(tmp_path), nodes=2)
    c.procs = {nid: _Proc() for nid in c.ids}
    c.proxy, c.client_proxy = proxy, client_proxy
    c._start_watcher()
    return c


def test_the_watcher_outlives_a_refusal_that_failed_and_tries_it_again(tmp_path):
    """A refusal that raises (here the first two) is kept in ``watch_errors`` and tried
    again at the next look; the watcher goes on with every node. Ended by it, a down
    node's links would accept (and reset) for the rest of the run, or a node back up
    would find its peers' links to it refusing for good: partitioned, with nothing
    said."""
    px, cpx = _Proxy(fail=2), _Proxy()
    c = _cluster(tmp_path, px, cpx)
    try:
        c.procs["n2"].up = False
        wait_until(lambda: ("n2", True) in px.calls, 5.0, what="n2's links refusing after two failures")
        assert ("n2", True) in cpx.calls and ("n2" + GRPC, True) in cpx.calls
        assert len(c.watch_errors) == 2 and all("Address already in use" in e for e in c.watch_errors)
        c.procs["n1"].up = False  # the watcher still watches every node
        wait_until(lambda: ("n1", True) in px.calls, 5.0, what="n1's links refusing")
        c.procs["n2"].up = True
        wait_until(lambda: ("n2", False) in px.calls, 5.0, what="n2's links listening again")
        assert c._watcher.is_alive()
    finally:
        c.close()
    assert not c._watcher.is_alive() and px.closed and cpx.closed


def test_close_kills_the_nodes_even_when_stopping_the_watcher_fails(tmp_path):
    """Whatever fails while the watcher is stopped, close() still kills every node and
    closes the proxies: a node left running goes on calling its peers' old addresses,
    and a later cluster on this machine that took one of those ports gets frames from
    a primary of another cluster whose members have the same names (it happened once:
    a replica took records it could not square with its new primary's and never caught
    up again)."""
    import pytest

    px = _Proxy()
    c = _cluster(tmp_path, px)

    class _Stuck:
        def is_alive(self):
            return True

        def join(self, timeout=None):
            raise RuntimeError("the watcher cannot be joined")
    real, c._watcher = c._watcher, _Stuck()
    try:
        with pytest.raises(RuntimeError, match="cannot be joined"):
            c.close()
        assert not any(p.alive() for p in c.procs.values()) and px.closed
    finally:
        c._watch_stop.set()
        real.join(timeout=5)
