"""Two builds side by side in one cluster, as a rolling upgrade has them: nodes of
an earlier release, run from this checkout's git history (tests/drills/builds.py),
beside nodes of this checkout (docs/upgrades.md). Skipped where the history is not
there to build from (a shallow clone)."""
import subprocess

import pytest

from drills import builds
from nodeproc import wait_until, start_cluster
from spooler import errors
from test_cluster import FAILOVER_S, client, primary_of, send_until_ok, until_ok


def _older(tmp_path_factory, version):
    root = builds.repo_root()
    try:
        commit = builds.release_end(root, version)
    except (LookupError, subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"this checkout's history does not hold {version}: {e}")
    return builds.extract(commit, str(tmp_path_factory.mktemp(f"build-{version}")), root)


@pytest.fixture(scope="module")
def before_purge(tmp_path_factory):
    """0.4.41, the last release without purge (log format 0)."""
    return _older(tmp_path_factory, "0.4.41")


def _upgrade(node):
    """A rolling upgrade's step: stopped (SIGTERM; a primary hands over), started on this build."""
    assert node.stop() == 0
    node.entry = list(node.DEFAULT_ENTRY)
    node.start()


def _version(node):
    return next(s.labels["version"] for s in node.samples("spooler_build_info"))


def test_a_purge_waits_until_every_member_runs_a_build_that_has_it(tmp_path, before_purge):
    """Three 0.4.41 nodes, upgraded one at a time. Asked of an upgraded replica
    while the primary still runs 0.4.41 (which has no purge: its answer to the
    forwarded call is UNIMPLEMENTED), a purge is 503 unavailable saying the
    primary must be upgraded, not method_not_allowed; asked of an upgraded
    primary while 0.4.41 members answer it, 503 naming them (their
    acknowledgements carry no log format). Nothing is purged meanwhile. Once all
    three run this build, the purge takes every message on every member."""
    from spooler import __version__
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S, entry=builds.entry(before_purge))
    try:
        assert {_version(n) for n in nodes.values()} == {"0.4.41"}
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("q"), what="the queue")
        for body in (b"a", b"b", b"c"):
            send_until_ok(c, "q", body)
        r = next(i for i in sorted(nodes) if i != p)
        _upgrade(nodes[r])
        assert _version(nodes[r]) == __version__
        e = wait_until(lambda: _refusal(client(nodes[r])), 10, what="a purge refused for the primary's build")
        assert f"the primary (at {nodes[p].grpc_target})" in str(e) and "upgrade it" in str(e), e
        # the upgraded node takes over; the two others still run 0.4.41
        assert until_ok(lambda: client(nodes[p]).promote(r), what="the switchover")["primary"] == r
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="the upgraded primary")
        assert p == r
        c = client(nodes[p])
        olds = sorted(i for i in nodes if i != p)
        e = wait_until(lambda: _refusal(c), 10, what="a purge refused for the members' build")
        assert all(i in str(e) for i in olds) and "0.4.42" in str(e), e
        assert c.get_queue("q")["stats"]["visible"] == 3
        for i in olds:
            _upgrade(nodes[i])
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
        assert until_ok(lambda: client(nodes[p]).purge("q"), 20, what="the purge") == 3
        for i, n in nodes.items():
            assert _version(n) == __version__
            wait_until(lambda: [x.value for x in n.samples("spooler_queue_events_total")
                                if x.labels == {"queue": "q", "event": "purged"}] == [3.0], 10,
                       what=f"the purge applied on {i}")
    finally:
        for n in nodes.values():
            n.kill()


def _refusal(c):
    """A purge's refusal for a build that cannot purge (None: refused for another
    reason, such as no primary known yet, as a node just started says)."""
    try:
        c.purge("q")
    except errors.Unavailable as e:
        return e if "0.4.42" in str(e) else None
    raise AssertionError("a purge went through while a member runs 0.4.41")


@pytest.fixture(scope="module")
def before_digest(tmp_path_factory):
    """0.4.44, the last release whose snapshot copies carry no digest."""
    return _older(tmp_path_factory, "0.4.44")


@pytest.mark.parametrize("old_side", ["primary", "replica"])
def test_a_snapshot_copy_crosses_0_4_44_and_this_build_either_way(tmp_path, before_digest, old_side):
    """A replica that fell behind the primary's compacted log catches up from a
    copy when one of the two runs 0.4.44: a 0.4.44 primary sends no digest (this
    build's replica installs its copy as before), and a 0.4.44 replica ignores
    the digest this build's primary sends (docs/upgrades.md, 0.4.45)."""
    from spooler import __version__
    from test_cluster import view
    from integration.test_snapshot import _compacted
    old = builds.entry(before_digest)
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S, extra_args=["--log-keep-records", "10"],
                          entry=old if old_side == "primary" else None)
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 20, what="a primary")
        c = client(nodes[p])
        until_ok(lambda: c.put_queue("q"), what="the queue")
        down = next(i for i in sorted(nodes) if i != p)
        nodes[down].kill()
        for i in range(60):
            send_until_ok(c, "q", f"m{i}".encode())
        top = view(nodes[p])["appliedLsn"]
        wait_until(lambda: _compacted(nodes[p], top), 15, what="the primary to compact its log")
        nodes[down].entry = list(nodes[down].DEFAULT_ENTRY) if old_side == "primary" else old
        nodes[down].start()
        assert _version(nodes[down]) == ("0.4.44" if old_side == "replica" else __version__)
        assert _version(nodes[p]) == ("0.4.44" if old_side == "primary" else __version__)
        wait_until(lambda: (view(nodes[down]) or {}).get("appliedLsn", -1) >= top, 20,
                   what="the lagging replica to catch up")
        wait_until(lambda: "installed a snapshot" in nodes[down].read_log(), 5, what="the snapshot log line")
        assert "does not hash" not in nodes[down].read_log()
        if old_side == "primary":  # this build's replica says the copy went unchecked
            assert "came without a digest" in nodes[down].read_log()
    finally:
        for n in nodes.values():
            n.kill()
